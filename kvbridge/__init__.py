"""kvbridge: KV-cache transfer connector for disaggregated LLM serving.

Layers (lower never import higher): ``paged`` -> ``topology`` -> ``kernels`` ->
``transfer`` -> ``connector`` -> ``engine``. See docs/ and the README.
"""

__version__ = "0.1.0"
