"""The parts of a calibration, one concern per module; :mod:`sim.calibrate` fits a file from measurements and
re-exports the API other code uses.

* :mod:`sim.calibration.measurements`: measurement documents, rows -> curve points, the fixed cost, the hold-out;
* :mod:`sim.calibration.forms`: one curve's fit (a physical base form times the fit-point residual);
* :mod:`sim.calibration.kernel_maps`: dense GEMMs and decode attention priced per kernel from a kernel map;
* :mod:`sim.calibration.files`: calibration files, the shipped ones and which one a simulation uses;
* :mod:`sim.calibration.predict`: the simulator's prediction for a measured row (``rackbed validate``).
"""
