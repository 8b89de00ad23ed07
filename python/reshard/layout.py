"""Placeholder: the geometry module is being written (issue 3)."""


def _todo(*args, **kwargs):
    raise NotImplementedError("reshard.layout is being written")


Layout = Piece = Storage = TensorLayout = flat = nest = replicated = split = _todo
