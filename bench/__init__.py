"""lorafleet.bench"""
