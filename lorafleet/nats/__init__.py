"""How lorafleet talks to NATS: client settings, roles and their permissions, credentials, TLS, the embedded server and
cluster, and the JetStream layout of streams and consumers.

Imports `lorafleet.core` only. (Inside this package `import nats` is the nats-py library: imports are absolute.)
"""
