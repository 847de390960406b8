"""lorafleet.registry"""
