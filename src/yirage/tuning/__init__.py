"""Kernel choice by measurement: the machine profile (which provider runs each library op, per
shape class, on this machine) and the measuring that fills it. Backends read it when they bind
an op; it sits above the runtime (its timing harness) and below the backends."""
