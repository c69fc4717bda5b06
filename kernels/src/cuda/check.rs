//! GPU self-check (filled in next).
