"""The superoptimizer: candidate µGraphs (mugraph.py for shared-row matmuls, attention.py for
attention) searched, verified and timed (superoptimize.py). Sits between the front end
(yirage/kernel.py) and the backends."""
