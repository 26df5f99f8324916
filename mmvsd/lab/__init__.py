"""Prototypes on their way into the core: real small models built from the weights that ship offline."""
