"""lorafleet.sidecar"""
