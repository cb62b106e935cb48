package android.view;
/** Type-checking stub (signatures as in android.jar). */
public class View { public View(android.content.Context context) {} }
