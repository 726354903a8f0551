//! gdrvm's end-to-end tests, one module per feature. They form one test binary so that the
//! fixture's batch of guests (see `gdrvm_e2e`) boots once per run: one L1 boot when nested.

mod apt_lists;
mod bad_input;
mod boot;
mod capture;
mod emulated;
mod fabric;
mod nested_failure;
mod numa;
mod pci;
mod regress;
mod vfio;
