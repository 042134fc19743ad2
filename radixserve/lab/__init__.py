"""Policy comparisons: built-in workloads and traces, a cost-model simulator over the real scheduler, live replay
against a server, tables and plots. The command line is ``radixserve compare``."""
