"""The superoptimizer: candidate µGraphs (mugraph.py) searched, verified and timed
(superoptimize.py). Sits between the front end (yirage/kernel.py) and the backends."""
