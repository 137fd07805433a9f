"""Scale-out on torch.distributed: process groups, the tensor-parallel group a model is built
with, and its collectives. Imports nothing above itself (model layers call down into it)."""
