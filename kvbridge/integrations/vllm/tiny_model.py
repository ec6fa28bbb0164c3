"""A random-weight Llama small enough for vLLM on two CPU cores, made on the spot.

For trying kvbridge in vLLM where no model hub is reachable (the vLLM tests,
``kvbridge bench vllm``, ``examples/vllm``): ``python -m
kvbridge.integrations.vllm.tiny_model DIR`` writes a ``transformers`` Llama
with random weights, a byte-level BPE tokenizer trained on a generated
corpus and a plain chat template (for ``/v1/chat/completions``). Byte-level
BPE maps every byte to a token first, so any text round-trips
(``decode(encode(text)) == text``).

Everything is a function of ``seed``: the same seed writes byte-identical
``model.safetensors`` and ``tokenizer.json``, so greedy outputs can be compared
across servers and runs.

Its answers mean nothing; they are only the same wherever the model runs.
The tests call it in a subprocess so that ``transformers`` never loads into
the pytest process that runs the rest of the suite.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

Dtype = Literal["bfloat16", "float32"]

BOS, EOS = "<s>", "</s>"
#: A plain chat template (vLLM serves chat completions only for a tokenizer with one):
#: each message as ``<|role|>`` and its text, the answer after ``<|assistant|>``.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
VOCAB_SIZE = 512
MAX_POSITION_EMBEDDINGS = 8192  # prompts of ~4k tokens plus their completions
HEAD_DIM = 32

# Words for the tokenizer's training corpus: enough shared sub-words for the
# merges to look like English. Any text still encodes, byte by byte if need be.
_CORPUS_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will more other its time only new some could these two may first then do any "
    "like my now over such our man me even most made after also did many before must "
    "through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three cache block token "
    "prefill decode transfer memory layer head server request model"
)


def build_tiny_llama(
    out_dir: str | Path,
    *,
    dtype: Dtype = "bfloat16",
    initializer_range: float = 0.02,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
) -> Path:
    """Write a random-weight Llama, its tokenizer and generation config to ``out_dir``.

    The default shape (hidden 128, 2 layers, 4 query heads of 32, 2 KV heads)
    splits evenly over tensor-parallel 2. Larger shapes keep heads of 32 and
    the 2:1 ratio of query to KV heads (hidden 512: 16 query, 8 KV heads), and
    an MLP twice as wide as the hidden size. A wider ``initializer_range``
    (0.2) spreads the logits so that greedy picks survive the different
    reduction order of tensor parallelism, in float32; in bfloat16 they do not.

    Args:
        out_dir: Folder to write (created if missing; files in it are replaced).
        dtype: Weight dtype stored and named in ``config.json``.
        initializer_range: Standard deviation of the random weights.
        seed: Seeds the weights and the training corpus; same seed, same files.
        hidden_size: Model width, a multiple of ``2 * HEAD_DIM`` (64).
        num_layers: Decoder layers (each holds one K and one V cache).

    Returns:
        ``out_dir`` as a ``Path``, ready for ``vllm ... --model out_dir``.

    Raises:
        ValueError: ``hidden_size`` not a positive multiple of 64, or
            ``num_layers`` below 1.

    Side effects:
        None on the caller's torch RNG (the weights are drawn in a forked RNG).
    """
    if hidden_size < 2 * HEAD_DIM or hidden_size % (2 * HEAD_DIM):
        raise ValueError(f"hidden_size {hidden_size} is not a positive multiple of "
                         f"{2 * HEAD_DIM}")
    if num_layers < 1:
        raise ValueError(f"num_layers {num_layers} < 1")
    num_heads = hidden_size // HEAD_DIM
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(seed)
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads // 2,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        do_sample=False,
    ).save_pretrained(out)
    return out


def _train_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``VOCAB_SIZE`` tokens that prepends ``<s>`` like Llama's."""
    rng = random.Random(seed)
    words = _CORPUS_WORDS.split()
    corpus = [" ".join(rng.choices(words, k=rng.randint(5, 30))) + "." for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        chat_template=CHAT_TEMPLATE,
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m kvbridge.integrations.vllm.tiny_model OUT_DIR [--hidden N] [--layers N] ...``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--initializer-range", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128,
                        help="hidden size, a multiple of 64 (default 128)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    args = parser.parse_args(argv)
    build_tiny_llama(
        args.out_dir, dtype=args.dtype, initializer_range=args.initializer_range, seed=args.seed,
        hidden_size=args.hidden, num_layers=args.layers,
    )


if __name__ == "__main__":
    main()
