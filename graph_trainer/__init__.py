"""graph-trainer: LLM training where the whole train step is a graph you can see, transform and compile."""

__version__ = "0.1.0"
