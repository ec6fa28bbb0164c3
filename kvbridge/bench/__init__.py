"""The benchmarks ``kvbridge bench`` runs, shipped with the package.

Top of the layer stack beside ``cli``: modules here may import any part of
kvbridge, and only ``kvbridge/cli/bench.py`` imports them (when the command
runs). An installed kvbridge runs them as a source checkout does, against
loopback pairs it starts itself or, for ``serve --url``, a deployment that is
already running. Map::

    cli.py             ``kvbridge bench`` parser; run, table, JSON, PNG per benchmark
    tables.py          the tables printed, and each benchmark's pass/fail checks
    plots.py           the PNGs (matplotlib, the ``bench`` extra)
    paged_bench.py     the reference engine's paged KV manager
    kernel_bench.py    pack / unpack GB/s against memcpy and the three-pass relayout
    transfer_bench.py  TransferAgent reads beside the peers (loopback, or --netns)
    transfer_agents.py   kvbridge's serving and reading agent processes
    peers/             NIXL, Mooncake and ucx_perftest on the same workload
    e2e_bench.py       TTFT and decode rate, P/D against colocated (reference engine)
    vllm_bench.py      TTFT and KV load time of P/D in vLLM (servers it starts)
    vllm_models.py     the random-weight models the vLLM benchmarks build
    vllm_servers.py    vLLM server processes, their metrics
    proc_cpu.py        CPU time of process groups (idle-CPU figures)
    serve_bench.py     goodput and latency under load (``vllm bench serve``)
    serve_configs.py   the configurations ``serve`` starts: servers + front end
    serve_client.py    ``vllm bench serve`` run once per sweep point
    serve_capacity.py  rate points as shares of the host's measured capacity

Scripts that are not ``kvbridge bench`` subcommands (soak runs, the GPU
checks, single measurements) stay in the checkout's ``benchmarks/``.
"""
