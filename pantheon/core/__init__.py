"""What the router and the workers both import, and nothing else of pantheon (the import
contract checks it): the wire (``protocol``: typed messages, die ids, exit codes), model
descriptions read from files (``description``, one module per family in ``archs``, ``gguf``,
``embedding``, ``grammar_vocab``), their ``sizing``, and the CURVE key files (``curve``). No torch,
no HTTP: a worker pulls in nothing of the router by importing it.
"""
