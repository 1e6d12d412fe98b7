"""A sweep's children spread over the GPUs of one host (``engine=local``) or of a Ray cluster (``engine=ray``).

:mod:`vitreg.fleet.axes` turns the sweep's lists and ``--axis`` options into checked combinations;
:mod:`vitreg.fleet.local` runs them on this host, :mod:`vitreg.fleet.ray_engine` as Ray tasks;
:mod:`vitreg.fleet.board` is the live line both show. :mod:`vitreg.bench.sweep` holds the parent run.
"""
