"""lorafleet.tune"""
