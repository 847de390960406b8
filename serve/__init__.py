"""lorafleet.serve"""
