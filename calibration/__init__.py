"""Shipped calibrations (package data ``rackbed.calibration``): the files ``sim.calibrate`` chooses from; see README.md."""
