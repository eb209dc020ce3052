"""The KV relay and its `tcp` transport: a blob store by (key, index) over TCP, across pods and nodes."""
