//! Fault tests inside one process: wrong secrets, garbage on a rank's port, a
//! rank that leaves in the middle of an operation.
