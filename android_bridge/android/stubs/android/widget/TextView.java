package android.widget;
/** Type-checking stub (signatures as in android.jar). */
public class TextView extends android.view.View {
    public TextView(android.content.Context context) { super(context); }
    public final void append(CharSequence text) {}
}
