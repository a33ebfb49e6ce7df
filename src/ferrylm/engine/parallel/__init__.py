"""Tensor parallel at run time: the rank group (``group.py``), the step broadcast from rank 0 to the followers
(``step_sync.py``) and the follower ranks' loop (``follower.py``). The model's split is ``models/tensor_parallel.py``."""
