package android.os;
/** Type-checking stub. */
public final class Bundle {}
