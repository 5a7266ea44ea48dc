"""Pages that show more than one app's data side by side: the home dashboard (my jobs beside
my projects' quota bars) and the project page (members and roles beside GPU use and job
templates). They sit above the apps they compose (docs/design.md section 2, "Layers"); a page
of one app lives in that app's views.py."""
