pub mod weights;
