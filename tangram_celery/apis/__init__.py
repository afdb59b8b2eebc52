"""Built-in API handlers used by the embedded default and the demo."""
