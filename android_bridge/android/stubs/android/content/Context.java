package android.content;
/** Type-checking stub (signatures as in android.jar); never shipped, never run. */
public abstract class Context {
    public abstract java.io.File getFilesDir();
    public abstract android.content.res.AssetManager getAssets();
}
