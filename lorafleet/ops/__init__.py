"""Running lorafleet on a machine: the local cluster (`lorafleet up`/`down`/`status`), its supervisor and
processes, the thread plan, and the layout keeper that holds the admin credential.

Imports `lorafleet.core`, `lorafleet.nats` and `lorafleet.core.model_source`; no stage.
"""
