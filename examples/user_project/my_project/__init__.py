"""An example user project: its own model, dataset, loss and metric, trained by ddp_exp."""
