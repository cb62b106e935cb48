/* Stand-in for bionic's libm.so: the JNI library imports nothing from it. */
int edge_spec_libm_shim;
