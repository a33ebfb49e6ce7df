"""Tensor parallel at run time: the rank group (``group.py``), the step broadcast from rank 0 to the followers
(``step_sync.py``), the follower ranks' process (``follower.py``, torch-free at import) and their loop
(``follower_runner.py``). The model's split is ``models/tensor_parallel.py``."""
