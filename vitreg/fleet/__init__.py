"""A sweep's children spread over the GPUs of one host (``engine=local``), a Ray cluster (``engine=ray``)
or a SLURM cluster (``engine=slurm``).

:mod:`vitreg.fleet.axes` turns the sweep's lists and ``--axis`` options into checked combinations;
:mod:`vitreg.fleet.local` runs them on this host, :mod:`vitreg.fleet.ray_engine` as Ray tasks,
:mod:`vitreg.fleet.slurm_engine` as SLURM jobs;
:mod:`vitreg.fleet.board` is the live line they all show. :mod:`vitreg.bench.sweep` holds the parent run.
"""
