"""lorafleet.research"""
