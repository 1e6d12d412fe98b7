"""Model families, building a model, FLOPs and memory floors."""
