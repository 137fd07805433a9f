"""Executors: how the engine's steps reach the workers. In-process (one worker, called directly)
or multi-process (one worker per rank over torch.distributed)."""
