"""Built-in pipelines. Each is a complete example of a raytrain.Pipeline (model, data, loss)."""
