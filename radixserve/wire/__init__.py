"""What travels between the processes: every message a typed msgspec Struct (``messages``: the actors' protocol;
``plans``: the scheduler's step plans for the model runner and its results), encoded as msgpack with numpy arrays
as raw bytes (``codec``). Both sides import these; they import nothing of either side."""
