"""Launchers: who starts the roles of a job, over one supervision rule (``supervisor``).

``local``: every role as a child process of ``engine train CONFIG`` on this machine. The recovery rule
(restart the whole cluster from the newest complete checkpoint) lives in ``supervisor``; launchers for
other schedulers reuse it. This package's ``__init__`` imports nothing, so a worker importing
``engine.progress`` or a test importing ``engine.launch.local`` pulls in no more than it needs.
"""
