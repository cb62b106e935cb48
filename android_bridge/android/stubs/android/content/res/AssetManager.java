package android.content.res;
/** Type-checking stub (signatures as in android.jar). */
public final class AssetManager {
    public String[] list(String path) throws java.io.IOException { throw new RuntimeException("stub"); }
    public java.io.InputStream open(String fileName) throws java.io.IOException { throw new RuntimeException("stub"); }
}
