"""The router's side of the router <-> worker link.

- ``pool``: ``WorkerPool``, the facade the rest of the router uses (spawn, load, submit,
  supervise); it re-exports the errors and ``RequestStream``;
- ``peer``: the pool's state for one worker, and how that worker's messages change it;
- ``link``: the one ZeroMQ ROUTER socket and the heartbeat's liveness verdict;
- ``process``: a worker's process: argv, environment, output, killing, exit codes in words;
- ``streams``: ``RequestStream``, one request's tokens;
- ``errors``: ``PoolError`` and its subclasses;
- ``curve``: CURVE keys for workers on other hosts (checked and loaded; not served yet).
"""
