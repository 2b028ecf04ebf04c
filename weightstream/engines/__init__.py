"""Adapters that let serving engines select weightstream's loaders (``--load-format``).

Importing this package, or ``weightstream``, imports no engine: each adapter imports its engine
when it is used, and says how to install it when it is missing.
"""
