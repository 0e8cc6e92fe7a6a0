"""Client side: the ClientApp and local trainers."""
