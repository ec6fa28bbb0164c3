"""The ``kvbridge`` command: ``kvbridge demo | serve | proxy | bench``.

Top of the layer stack: modules here may import any other part of kvbridge;
nothing else in the package imports them. One module per command::

    main.py       the ``kvbridge`` parser and entry point (``python -m kvbridge.cli``)
    serve.py      ``kvbridge serve``: flags -> ``EngineConfig``, engine + HTTP server
    proxy.py      ``kvbridge proxy``: the P/D router's flags and process
    lifecycle.py  what both share: bind first, the ready line, signals, uvicorn
    bench.py      ``kvbridge bench``: hand-off to ``kvbridge/bench/``
    demo/         ``kvbridge demo``: P, D and proxy on loopback, checked token for token

Heavy imports (torch, the engine, FastAPI) happen inside the commands, so
building the parser (``kvbridge --help``) stays quick.
"""
