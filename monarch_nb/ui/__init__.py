"""Notebook front ends: the ``%monarch`` magics, the dashboard widget and its
feed, and the JupyterLab extension's comm. Thin layers over the public
Python API (monarch_nb.mesh); nothing here touches sockets or controller
internals.
"""
