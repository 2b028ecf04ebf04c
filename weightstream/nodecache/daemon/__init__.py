"""The cache daemon, ``weightstream cache serve``: the server and what it keeps (see ``server``)."""
