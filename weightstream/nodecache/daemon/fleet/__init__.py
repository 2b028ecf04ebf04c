"""Fleet fill: node caches that fill each other, coordinated through etcd (``etcd``: the JSON gateway client;
``membership``: nodes under leases; ``claims``: one node per piece)."""
