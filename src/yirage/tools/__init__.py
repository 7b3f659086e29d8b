"""The seed's backend tools behind ``yirage optimize | benchmark | test | set`` and their Python
API (``yr.auto_configure_backend``, ``yr.BackendOptimizer``, ``yr.benchmark_backends``). They sit
above the engines and below the CLI; nothing below imports them."""
