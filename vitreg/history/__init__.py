"""A benchmark history: the runs of one configuration on one GPU over time, their change points, and the
verdict on a candidate run against them (``vitreg check``). Pure pandas and numpy: the check job reads the
runs through :mod:`vitreg.tracking` and hands this package the tidy frame."""
