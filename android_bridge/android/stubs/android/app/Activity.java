package android.app;
/** Type-checking stub (signatures as in android.jar). */
public class Activity extends android.content.Context {
    protected void onCreate(android.os.Bundle savedInstanceState) {}
    protected void onDestroy() {}
    public void setContentView(android.view.View view) {}
    public java.io.File getFilesDir() { throw new RuntimeException("stub"); }
    public android.content.res.AssetManager getAssets() { throw new RuntimeException("stub"); }
}
