"""The supervisor's side of the durable tier: which checkpoints go, the uploader, the hold while saving."""
