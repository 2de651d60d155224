"""The router's side of the router <-> worker link: worker processes, the ZeroMQ link, token streams, CURVE keys."""
