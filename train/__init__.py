"""python -m train: the zerofunc trainer."""
